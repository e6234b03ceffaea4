from .commands.cli import main

main()  # pylint: disable=no-value-for-parameter
