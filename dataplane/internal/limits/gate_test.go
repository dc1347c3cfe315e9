package limits

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestGateIsolation: with 2 deployments and one kept free (most 1), agent
// prefill runs on one deployment at a time, joins the deployment that has
// some, never starts on one with interactive prefill, and interactive
// requests are placed on the deployment without agent prefill; leaving
// opens the gate again.
func TestGateIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	g := "group-" + b.org
	enter := func(dep, id string) string {
		t.Helper()
		e, refused, err := b.lim.GateEnter(ctx, g, dep, id, 1)
		require.NoError(t, err)
		if refused != "" {
			require.Nil(t, e)
			return refused
		}
		require.Equal(t, dep, e.Deployment)
		return "ok"
	}

	a1, refused, err := b.lim.GateEnter(ctx, g, "d1", "a1", 1)
	require.NoError(t, err)
	require.Empty(t, refused)
	require.Equal(t, GateIsolation, enter("d2", "a2"), "d1 has agent prefill: d2 stays free")
	require.Equal(t, "ok", enter("d1", "a3"), "joining the deployment that has agent prefill")

	// Interactive: the free deployment, whatever the candidates' order.
	ie, idx, free, err := b.lim.GatePlace(ctx, g, "i1", []string{"d1", "d2"})
	require.NoError(t, err)
	require.Equal(t, 1, idx)
	require.True(t, free)
	require.Equal(t, "d2", ie.Deployment)
	require.Equal(t, GateInteractive, enter("d2", "a4"), "d2 has interactive prefill")

	// a1 and a3 reach their first tokens: d1 has no agent prefill, but d2
	// still has the chat's prefill.
	require.NoError(t, b.lim.GateLeave(ctx, a1))
	a3 := &GateEntry{keys: a1.keys, member: "a|d1|a3", Deployment: "d1"}
	require.NoError(t, b.lim.GateLeave(ctx, a3))
	require.Equal(t, GateInteractive, enter("d2", "a2"))
	require.NoError(t, b.lim.GateLeave(ctx, ie))
	require.Equal(t, "ok", enter("d2", "a2"))
	require.Equal(t, GateIsolation, enter("d1", "a5"))

	// Every candidate has agent prefill (most 2 lets both): the first.
	// Both deployments have agent prefill (most 2 lets a second run
	// start): an interactive request takes its first candidate.
	m1, refused, err := b.lim.GateEnter(ctx, g, "d1", "m1", 2)
	require.NoError(t, err)
	require.Empty(t, refused)
	require.Equal(t, "d1", m1.Deployment)
	ie, idx, free, err = b.lim.GatePlace(ctx, g, "i2", []string{"d2", "d1"})
	require.NoError(t, err)
	require.Equal(t, 0, idx)
	require.False(t, free)
	require.Equal(t, "d2", ie.Deployment)
}

// TestGateJoinWindow: a deployment whose run of agent prefill began more
// than GateJoinWindow ago takes no more agent prefill until the run ends.
func TestGateJoinWindow(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	g := "group-" + b.org
	a1, refused, err := b.lim.GateEnter(ctx, g, "d1", "a1", 1)
	require.NoError(t, err)
	require.Empty(t, refused)
	// The run began long ago (as if entries had overlapped since).
	keys := b.lim.gateKeys(g)
	old := time.Now().Add(-GateJoinWindow - time.Second).UnixMilli()
	require.NoError(t, b.rdb.HSet(ctx, keys[1], "d1", strconv.FormatInt(old, 10)).Err())
	_, refused, err = b.lim.GateEnter(ctx, g, "d1", "a2", 1)
	require.NoError(t, err)
	require.Equal(t, GateRunTooLong, refused)
	_, refused, err = b.lim.GateEnter(ctx, g, "d2", "a2", 1)
	require.NoError(t, err)
	require.Equal(t, GateIsolation, refused)
	// The run ends: a new one starts, on either deployment.
	require.NoError(t, b.lim.GateLeave(ctx, a1))
	_, refused, err = b.lim.GateEnter(ctx, g, "d2", "a2", 1)
	require.NoError(t, err)
	require.Empty(t, refused)
	_, refused, err = b.lim.GateEnter(ctx, g, "d2", "a3", 1)
	require.NoError(t, err)
	require.Empty(t, refused, "a young run takes more")
}

// TestGateEntriesExpire: a lost proxy's entries stop counting one lease
// TTL after their last renewal; a renewed entry keeps counting; an
// expired entry is not revived by a late renewal.
func TestGateEntriesExpire(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	g := "group-" + b.org
	cfg := b.lim.cfg
	cfg.LeaseTTL, cfg.RenewInterval = 400*time.Millisecond, 100*time.Millisecond
	short, err := New(cfg)
	require.NoError(t, err)

	// The renewed entry (d1) keeps d2 closed past several TTLs.
	kept, refused, err := short.GateEnter(ctx, g, "d1", "kept", 1)
	require.NoError(t, err)
	require.Empty(t, refused)
	deadline := time.Now().Add(3 * cfg.LeaseTTL)
	for time.Now().Before(deadline) {
		live, err := short.GateRenew(ctx, kept)
		require.NoError(t, err)
		require.True(t, live)
		_, refused, err = b.lim.GateEnter(ctx, g, "d2", "other", 1)
		require.NoError(t, err)
		require.Equal(t, GateIsolation, refused)
		time.Sleep(cfg.RenewInterval) // the renewal cadence under test, not a wait for a condition
	}

	// The proxy is lost: no more renewals. Its entry expires and d2 opens.
	testsvc.Eventually(t, func() bool {
		_, refused, err := b.lim.GateEnter(ctx, g, "d2", "other", 1)
		require.NoError(t, err)
		return refused == ""
	}, 5*time.Second, 20*time.Millisecond, "a lost proxy's gate entry expires")
	live, err := short.GateRenew(ctx, kept)
	require.NoError(t, err)
	require.False(t, live, "an expired entry is not revived")

	// An interactive entry of a lost proxy expires too.
	ie, _, _, err := short.GatePlace(ctx, g, "chat", []string{"d3"})
	require.NoError(t, err)
	require.Equal(t, "d3", ie.Deployment)
	_, refused, err = b.lim.GateEnter(ctx, g, "d3", "late", 3)
	require.NoError(t, err)
	require.Equal(t, GateInteractive, refused)
	testsvc.Eventually(t, func() bool {
		_, refused, err := b.lim.GateEnter(ctx, g, "d3", "late", 3)
		require.NoError(t, err)
		return refused == ""
	}, 5*time.Second, 20*time.Millisecond, "a lost proxy's interactive gate entry expires")
}
