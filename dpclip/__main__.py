from dpclip.cli.entry import run

run()
