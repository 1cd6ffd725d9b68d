"""``python -m trio_pd``: the command line (see ``trio_pd._cli``)."""

from trio_pd._cli import main

if __name__ == "__main__":
    main()
