package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/internal/testsvc"
)

// tickEnv is a handler whose limiter has lease TTL ttl and renew interval
// every, with n leases admitted on one concurrency-limited scope, each
// held by an exchange of its own (not started).
func tickEnv(t *testing.T, ttl, every time.Duration, n int) (*env, *redis.Client, string, []*exchange) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "rt" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() { delPrefix(rdb, prefix) })
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	lim, err := limits.New(limits.Config{Pipe: pipe, KeyPrefix: prefix, CallTimeout: time.Second, LeaseTTL: ttl, RenewInterval: every})
	require.NoError(t, err)
	require.NoError(t, lim.Bootstrap(context.Background(), "o1"))
	e := newEnv(t, func(c *Config) { c.Limiter = lim })
	var xs []*exchange
	for i := range n {
		d, err := lim.Admit(context.Background(), limits.Request{OrgID: "o1", RequestID: fmt.Sprint("r", i),
			Scopes: []limits.Scope{{Kind: limits.KindKey, ID: "k", MaxParallel: 1000}}})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		x := &exchange{h: e.h, id: fmt.Sprint("r", i)}
		x.leases.main = d.Lease
		xs = append(xs, x)
	}
	return e, rdb, prefix + "{o:o1}:par:key:k", xs
}

func (t *renewTick) counts() (batches, renewed int, running bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.batches, t.renewed, t.running
}

// TestRenewalTickBatchesLeases: 20 live requests are renewed on the
// handler's one tick, together (one batch each round, not a timer and a
// call each), so their 1 s leases stay live for as long as they run;
// once they stop, the tick's goroutine ends.
func TestRenewalTickBatchesLeases(t *testing.T) {
	e, rdb, par, xs := tickEnv(t, time.Second, 200*time.Millisecond, 20)
	for _, x := range xs {
		x.startRenewal()
	}
	tk := &e.h.renewals
	require.Equal(t, 20, tk.registered())
	// Ten rounds each: 2 s, twice the lease TTL.
	testsvc.Eventually(t, func() bool { _, n, _ := tk.counts(); return n >= 200 }, 20*time.Second, 10*time.Millisecond)
	live, err := rdb.ZCount(context.Background(), par, "("+strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
	require.NoError(t, err)
	require.EqualValues(t, 20, live, "every lease outlived its TTL by being renewed")
	batches, renewed, _ := tk.counts()
	require.GreaterOrEqual(t, renewed/batches, 10, "renewals share batches (%d in %d)", renewed, batches)
	for _, x := range xs {
		x.stopRenewal()
	}
	require.Zero(t, tk.registered())
	testsvc.Eventually(t, func() bool { _, _, run := tk.counts(); return !run }, 5*time.Second, 10*time.Millisecond)
}

// TestRenewalTickKick: a kicked request is renewed at once, long before
// its renewal is due.
func TestRenewalTickKick(t *testing.T) {
	e, _, _, xs := tickEnv(t, 30*time.Second, 10*time.Second, 1)
	x := xs[0]
	x.startRenewal()
	t.Cleanup(x.stopRenewal)
	tk := &e.h.renewals
	start := time.Now()
	x.renewal.kick()
	testsvc.Eventually(t, func() bool { _, n, _ := tk.counts(); return n == 1 }, 5*time.Second, time.Millisecond)
	require.Less(t, time.Since(start), 5*time.Second)
	x.renewal.kick()
	testsvc.Eventually(t, func() bool { _, n, _ := tk.counts(); return n == 2 }, 5*time.Second, time.Millisecond)
}

// TestRenewalTickFirstRenewalBound: a request's first periodic renewal runs
// between 7/8 and 9/8 of a renew interval after it registered (due one
// interval later, run by the first tick within half a tick of that; a tick
// is a quarter interval). This is the bound docs/limits.md ("Lost
// requests") gives for a request admitted entirely from quota slices: its
// record is written by the first renewal at least half an interval after
// its admission, so a data plane killed before that renewal leaves no usage
// event for it.
func TestRenewalTickFirstRenewalBound(t *testing.T) {
	const every = 400 * time.Millisecond
	for range 3 {
		e, _, _, xs := tickEnv(t, 30*time.Second, every, 1)
		x := xs[0]
		tk := &e.h.renewals
		start := time.Now()
		x.startRenewal()
		testsvc.Eventually(t, func() bool { _, n, _ := tk.counts(); return n >= 1 }, 10*time.Second, time.Millisecond)
		took := time.Since(start)
		x.stopRenewal()
		t.Logf("first periodic renewal %s after registration (renew interval %s)", took.Round(time.Millisecond), every)
		require.GreaterOrEqual(t, took, every*7/8, "renewed before its first renewal was due")
		// 9/8 of the interval, plus the tick's scheduling on a loaded
		// machine (the bound is what the tick asks for, not a real-time
		// guarantee).
		require.Less(t, took, every*9/8+250*time.Millisecond, "the first periodic renewal came late")
	}
}
