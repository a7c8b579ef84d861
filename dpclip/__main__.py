from dpclip.cli.main import run

run()
