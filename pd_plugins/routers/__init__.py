"""DisaggPrefillRouter (`pd-router`): picks prefill and decode workers and drives the PD flow."""
