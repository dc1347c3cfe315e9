package limits

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestRenewBatchFoldsOrgs: RenewBatch renews the plain leases of one org
// in one renew.lua call and those of another org in a second, with every
// state a renewal can have (extended, re-asserted, settled elsewhere,
// repeated in the batch), and pushes every lease of a shared scope.
func TestRenewBatchFoldsOrgs(t *testing.T) {
	t.Parallel()
	const ttl = 5 * time.Second
	// A Redis of its own: the test counts its EVALSHA calls.
	b := setupAt(t, startBenchRedis(t), func(c *Config) { c.LeaseTTL = ttl })
	ctx := context.Background()
	orgB := "org-" + randHex(t)
	b.primeEpoch(t, orgB)
	key := Scope{Kind: KindKey, ID: "k", TPM: 100_000, MaxParallel: 5, Budget: &Budget{CapMicros: 1_000_000, Window: "1d"}}
	team := Scope{Kind: KindTeam, ID: "t", MaxParallel: 10}
	var leases []*Lease
	for _, id := range []string{"a1", "a2", "a3", "a4"} {
		req := b.req(id, 100, 50, key, team)
		if id == "a4" {
			req.Report = &Report{Tokens: 1, CostMicros: 2, Event: []byte("ev")}
		}
		d := b.admit(t, req)
		require.True(t, d.Allowed)
		leases = append(leases, d.Lease)
	}
	other := b.req("b1", 100, 50, key)
	other.OrgID = orgB
	d := b.admit(t, other)
	require.True(t, d.Allowed)
	leases = append(leases, d.Lease)

	// a2's record is gone (as after a state loss): re-asserted. a3 was
	// settled by another data plane (the in-process flag bypassed).
	kb := newKeyBuilder(b.prefix, b.org)
	require.NoError(t, b.rdb.Del(ctx, kb.record("a2")).Err())
	_, err := b.lim.Settle(ctx, leases[2], 100, 50)
	require.NoError(t, err)
	leases[2].settled.Store(false)
	before := b.state(t, key)

	// The script loaded first (a NOSCRIPT answer counts as a call).
	st, err := b.lim.Renew(ctx, leases[4])
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	calls0 := evalshaCalls(t, b)
	start := time.Now()
	items := []RenewItem{{Lease: leases[0]}, {Lease: leases[1]}, {Lease: leases[2]}, {Lease: leases[0]},
		{Lease: leases[3], Report: &Report{Tokens: 7, CostMicros: 9, Event: []byte("ev2")}}, {Lease: leases[4]}}
	states, errs := b.lim.RenewBatch(ctx, items)
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, []RenewState{RenewExtended, RenewReasserted, RenewSettled, RenewExtended, RenewExtended, RenewExtended}, states)
	require.Equal(t, int64(2), evalshaCalls(t, b)-calls0, "one renew.lua call per org")

	// a2's estimate and reservation were written again; every live lease
	// of both scopes expires a lease TTL from the renewal.
	after := b.state(t, key)
	require.Equal(t, before.Tokens+100, after.Tokens)
	require.Equal(t, before.Spend+50, after.Spend)
	rec, err := b.rdb.Get(ctx, kb.record("a2")).Result()
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(rec, "100 50 "), rec)
	rec, err = b.rdb.Get(ctx, kb.record("a4")).Result()
	require.NoError(t, err)
	require.True(t, strings.HasSuffix(rec, "\n7 9\n"+leases[3].sweep.spec+"\nev2"), rec)
	for _, s := range []Scope{key, team} {
		zs, err := b.rdb.ZRangeWithScores(ctx, kb.scope(&s)[1], 0, -1).Result()
		require.NoError(t, err)
		got := map[string]bool{}
		for _, z := range zs {
			got[z.Member.(string)] = true
			require.GreaterOrEqual(t, int64(z.Score), start.Add(ttl).UnixMilli()-50, "lease %v of %s", z.Member, s.ID)
		}
		require.Equal(t, map[string]bool{"a1": true, "a2": true, "a4": true}, got, s.ID)
	}
	score, err := b.rdb.ZScore(ctx, kb.leaseIndex(), "a4").Result()
	require.NoError(t, err)
	require.GreaterOrEqual(t, int64(score), start.Add(ttl).UnixMilli()-50)
	zs, err := b.rdb.ZRangeWithScores(ctx, newKeyBuilder(b.prefix, orgB).scope(&key)[1], 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, zs, 1)
	require.GreaterOrEqual(t, int64(zs[0].Score), start.Add(ttl).UnixMilli()-50)
}

// evalshaCalls returns the EVALSHA calls b's Redis has run.
func evalshaCalls(t testing.TB, b *bundle) int64 {
	t.Helper()
	info, err := b.rdb.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:calls=")
		if ok {
			n, err := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
			require.NoError(t, err)
			return n
		}
	}
	return 0
}
