// Command sluice runs Sluice's planes: `sluice control` (control plane and
// admin API), `sluice migrate` (schema migrations) and `sluice dev` (the
// whole system on this machine for a first look).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "sluice:", err)
		os.Exit(1)
	}
}

const usage = `usage: sluice <command> [flags]

commands:
  control   run the control plane (admin API on --addr)
  proxy     run a data-plane proxy for one region
  migrate   apply database migrations and exit
  dev       run the whole system locally: migrates, seeds a demo org and prints how to call it

Run 'sluice <command> -h' for the flags of a command.
`

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command given")
	}
	switch args[0] {
	case "control":
		return runControl(ctx, args[1:], getenv, stderr)
	case "proxy":
		return runProxy(ctx, args[1:], getenv, stderr)
	case "migrate":
		return runMigrate(ctx, args[1:], getenv, stdout, stderr)
	case "dev":
		return runDev(ctx, args[1:], getenv, stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}
