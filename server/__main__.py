from pyturbo.server.cli import main

main()
