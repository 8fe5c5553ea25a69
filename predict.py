"""Predict with a trained model from a checkout: ``python predict.py +recipe=cfd
predict.checkpoint=<run directory> mesh=2x2 predict.resolution=256 predict.output=out.h5``.

The same command as ``shardsci-predict`` and ``python -m shardsci.predict``
(``shardsci/predict.py``).
"""

from shardsci.predict import main

if __name__ == "__main__":
    main()
