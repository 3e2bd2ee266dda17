"""Stage workers: stage runtimes that run outside the caller's process (a process, a Ray actor)."""
