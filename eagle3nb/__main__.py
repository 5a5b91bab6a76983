"""`python -m eagle3nb VERB ...` (and `torchrun -m eagle3nb train RECIPE`): the `eagle3nb` command."""

from eagle3nb.cli import main

if __name__ == "__main__":
    main()
