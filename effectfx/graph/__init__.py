"""FX graphs below capture: making and running them (:mod:`.build`, :mod:`.steps`, :mod:`.codegen`),
walking them -- nested subgraphs, and the one answer to "is this node effectful" (:mod:`.walk`) -- and the
records a trace leaves (tensor metadata, :mod:`.meta`; the user's source lines, :mod:`.source`)."""
