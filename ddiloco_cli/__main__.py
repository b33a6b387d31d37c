from ddiloco_cli.clibase import main

main()
