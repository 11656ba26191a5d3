"""The process: the WSGI app factory, waitress and its connection front, what is served, the doctor."""
