"""What the tests share, by concern: starting processes (launch.py), the runs they train and
read back (runs.py), what two runs must agree on and how closely (numerics.py), and headless
Chromium (browser.py). Each test imports what it uses from the module that holds it."""
