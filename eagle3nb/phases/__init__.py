"""The phases of a recipe as library objects: one module each, registered in `eagle3nb.phase.PHASES`."""
