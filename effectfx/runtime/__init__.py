"""Runtime: Programs that run captured graphs, and the compiled callable."""
