"""The bottom layer: settings, clock, errors, secret tokens, input validation. Imports nothing else of the appliance."""
