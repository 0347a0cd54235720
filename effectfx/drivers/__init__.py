"""The drivers, above everything they drive: ``efx.capture`` (:mod:`.capture`: trace the root, build the
Program, run the functionalization pass) and ``efx.compile`` (:mod:`.compile`: a module's compiled module;
:mod:`.callable`: the compiled callable -- signatures, guards, cached programs, backends)."""
