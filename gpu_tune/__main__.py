"""``python -m gpu_tune``: the ``gpu-tune`` command."""

from gpu_tune.cli import main

if __name__ == "__main__":
    main()
