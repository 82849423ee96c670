from pd_plugins.routers.cli import main

main()
