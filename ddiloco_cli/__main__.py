from ddiloco_cli.cli import main

main()
