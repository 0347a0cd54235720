"""The drivers, above everything they drive: ``efx.capture`` (:mod:`.capture`: trace the root, build the
Program, run the functionalization pass) and ``efx.compile`` (:mod:`.compile`: signatures, guards, cached
programs, backends)."""
