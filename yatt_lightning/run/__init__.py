"""The run's front door: the ``yatt`` command line, the checks before any engine starts, the one-screen
errors, the console and logging set-up."""
