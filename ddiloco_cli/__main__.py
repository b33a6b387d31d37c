from ddiloco_cli.cli.base import main

main()
