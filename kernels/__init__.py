"""The Triton kernels.  This top-level ``kernels/`` folder is installed as ``espert.kernels``
(``package_dir`` in setup.py), so code imports ``espert.kernels.apply``; a top-level package
named ``kernels`` would collide with the PyPI package of that name."""
