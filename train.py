"""Train a recipe from a checkout: ``python train.py +recipe=cfd mesh=4x2``.

The same command as ``shardsci-train`` and ``python -m shardsci.train`` (``shardsci/train.py``).
"""

from shardsci.train import main

if __name__ == "__main__":
    main()
