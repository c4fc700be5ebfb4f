from miles_core.cli import main

main()
