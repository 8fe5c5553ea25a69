"""Recipes: tasks that choose a model, data and evaluation and train them with
``shardsci.training``. Each sub-package registers itself when imported (NOTE [How train.py
finds recipes] in ``shardsci/training/_recipes.py``)."""
