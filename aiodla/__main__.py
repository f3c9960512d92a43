"""``python -m aiodla``: the command line (see ``aiodla._cli``)."""

from ._cli import main

if __name__ == "__main__":
    main()
