from dmlkit.cli import main

main()
