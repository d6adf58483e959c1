"""Whether a SIGINT or SIGTERM has arrived in this command (`entry.main` installs the handler).
A leaf: the entry point and the error handling (`common.user_errors`) both read it, and it imports
nothing, so it is safe to touch from a signal handler."""

interrupted = False  # a SIGINT or SIGTERM arrived: what fails after it is the interrupt's doing
reported = False  # its one line is out (`common.interrupt`): the entry point does not say it again
