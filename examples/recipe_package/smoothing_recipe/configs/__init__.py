"""The recipe's Hydra configs (a package, so ``pkg://smoothing_recipe.configs`` finds them)."""
