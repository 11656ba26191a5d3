"""What the JSON API and the console share: the answer shapes, the error and auth plugins, metrics."""
