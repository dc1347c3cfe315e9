// Package system holds Sluice's whole-system tests and scenario
// benchmarks: control planes, data planes, NATS, Postgres, Redis and
// simulated engines started by the e2e/harness package, driven over the
// public HTTP and admin APIs.
package system

import (
	"testing"

	"github.com/sluicegw/sluice/e2e/harness"
)

// dist is the harness's system with this package's helpers on it.
type dist struct{ *harness.Dist }

type (
	proxy        = harness.Proxy
	tenant       = harness.Tenant
	adminClients = harness.AdminClients
)

const (
	testPepper    = harness.Pepper
	testBootstrap = harness.Bootstrap
	testKEK       = harness.KEK
	testRedisAddr = harness.RedisAddr
)

func startDist(t testing.TB) *dist { return &dist{harness.Start(t)} }
