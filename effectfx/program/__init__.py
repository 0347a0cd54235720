"""Programs: what capture makes and every pass transforms -- ``Program`` and ``TrainingProgram``
(:mod:`.program`), their records (:mod:`.records`), their text (:mod:`.text`) and their file format
(:mod:`.serialize`)."""
