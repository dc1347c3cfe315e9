// Command sluicectl is the command-line client of the Sluice admin API
// (Connect RPC, sluice.admin.v1). Its command groups:
//
//   - login, context, whoami: saved contexts (server and tenant-scoped
//     admin token) and the identity in use;
//   - org, team, member, user, key, customer, token: create, get, list,
//     update and delete of the tenancy objects and admin tokens; block and
//     unblock; key rotation with a grace period;
//   - audit: list and verify the hash-chained audit trail;
//   - spend: spend totals per scope and per-request ledger records;
//   - model-group, deployment: model groups and their upstream deployments
//     (prices, capabilities, credentials);
//   - region, rollout, fleet: rollout policy per region, promotion and
//     rollback of config versions, and the data-plane fleet from its
//     heartbeats;
//   - apply, get, import: declarative YAML documents (apply -f with
//     --dry-run and --prune), the objects as documents, and the
//     translation of a LiteLLM config.yaml with a report of its traps.
//
// Output is a table, JSON or YAML (-o). See docs/sluicectl.md.
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
