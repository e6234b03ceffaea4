"""`python -m compiler` and the `mobilec` command."""

from .torch_hidden import hide_torch_from_tvm


def run() -> None:
    hide_torch_from_tvm()  # before the command imports TVM
    from .commands.cli import main  # pylint: disable=import-outside-toplevel

    main()  # pylint: disable=no-value-for-parameter


if __name__ == "__main__":
    run()
