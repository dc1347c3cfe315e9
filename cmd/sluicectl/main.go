// Command sluicectl is the command-line client of the Sluice admin API:
// contexts with tenant-scoped admin tokens, create/get/list/update/delete
// of orgs, teams, members, users, keys, customers and admin tokens, key
// rotation, block/unblock, the audit trail, and the data-plane fleet,
// regions and per-region rollout of config versions. See docs/sluicectl.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "sluicectl:", err)
		os.Exit(1)
	}
}
