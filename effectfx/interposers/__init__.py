"""Python-API interposers: what a capture puts in place of Python-level APIs (``print``, print options,
profiler ranges, ``backward()`` and optimizer steps, Dynamo's frame tracking, higher-order ops, effect
ops with composite kernels, collectives) so that captured code records them as effects.  Each is one
:func:`interpose` call; the capture session (``effectfx.capture.session``) installs them and removes them."""
