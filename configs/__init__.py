"""The Hydra configs of ``shardsci-train``, a package so that ``pkg://shardsci.configs`` finds
them once installed (NOTE [How shardsci's top-level directories are installed])."""
