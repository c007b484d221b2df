// Command limitmesh runs a limitmesh node and talks to one.
//
// See docs/cli.md for the commands; the implementation lives in package cli so
// that it can be imported and tested.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/limitmesh/limitmesh/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Environ(), os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
