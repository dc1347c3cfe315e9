package limits

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// prefillState reads a prefill scope's total and contributions.
func (b *bundle) prefillState(t testing.TB, s Scope) (total int64, parts map[string]int64) {
	t.Helper()
	k := newKeyBuilder(b.prefix, b.org).scope(&s)
	m, err := b.rdb.HGetAll(context.Background(), k[0]).Result()
	require.NoError(t, err)
	parts = map[string]int64{}
	var sum int64
	for f, v := range m {
		if len(f) > 2 && f[:2] == "p:" {
			n, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err)
			require.Positive(t, n, "a contribution of 0 is removed, not kept")
			parts[f[2:]] = n
			sum += n
		}
	}
	if v, ok := m[PrefillField]; ok {
		total, err = strconv.ParseInt(v, 10, 64)
		require.NoError(t, err)
	}
	require.Equal(t, sum, total, "the total is the sum of the contributions")
	return total, parts
}

func (b *bundle) prefillReq(id string, s Scope, tokens, limit int64) Request {
	r := b.req(id, 0, 0, s)
	r.Prefill = &Prefill{Scope: 0, Tokens: tokens, Cap: limit}
	return r
}

// TestPrefillAccounting: a prefill contribution is added by the admission,
// moved to zero at the first token, corrected, and removed when the lease
// is settled or cancelled; the cap rejects a request that would exceed it
// while prefill is in flight, and never one that finds none.
func TestPrefillAccounting(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindDeployment, ID: "d", MaxParallel: 8}

	a := b.admit(t, b.prefillReq("a", s, 6000, 10000))
	require.True(t, a.Allowed)
	require.Equal(t, int64(6000), a.PrefillInFlight)
	total, parts := b.prefillState(t, s)
	require.Equal(t, int64(6000), total)
	require.Equal(t, map[string]int64{"a": 6000}, parts)

	// Over the cap with a in prefill: rejected, nothing taken.
	c := b.admit(t, b.prefillReq("c", s, 5000, 10000))
	require.False(t, c.Allowed)
	require.Equal(t, LimitPrefill, c.Rejection.Limit)
	require.Equal(t, PrefillRetryAfter, c.Rejection.RetryAfter)
	require.Equal(t, int64(6000), c.PrefillInFlight)
	require.Equal(t, int64(1), b.state(t, s).Leases, "a prefill rejection takes no slot")
	// Without a cap (an interactive request) it is admitted and counted.
	i := b.admit(t, b.prefillReq("i", s, 5000, 0))
	require.True(t, i.Allowed)
	require.Equal(t, int64(11000), i.PrefillInFlight)

	// First token of a: its contribution goes to zero.
	require.NoError(t, b.lim.PrefillDone(ctx, a.Lease))
	total, parts = b.prefillState(t, s)
	require.Equal(t, int64(5000), total)
	require.Equal(t, map[string]int64{"i": 5000}, parts)
	require.Zero(t, a.Lease.Prefill())
	// A renewal after the first token keeps it at zero.
	st, err := b.lim.Renew(ctx, a.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	total, _ = b.prefillState(t, s)
	require.Equal(t, int64(5000), total)

	// A correction (the engine had 3000 of i's tokens cached).
	require.NoError(t, b.lim.SetPrefill(ctx, i.Lease, 2000))
	total, _ = b.prefillState(t, s)
	require.Equal(t, int64(2000), total)

	// Now c fits (2000 + 5000 ≤ 10000).
	c = b.admit(t, b.prefillReq("c", s, 5000, 10000))
	require.True(t, c.Allowed)
	require.Equal(t, int64(7000), c.PrefillInFlight)

	// Settling i (still in prefill) and cancelling c remove theirs.
	_, err = b.lim.Settle(ctx, i.Lease, 100, 0)
	require.NoError(t, err)
	_, err = b.lim.Cancel(ctx, c.Lease)
	require.NoError(t, err)
	total, parts = b.prefillState(t, s)
	require.Zero(t, total)
	require.Empty(t, parts)
	// Settling a (past its first token) changes nothing.
	_, err = b.lim.Settle(ctx, a.Lease, 100, 0)
	require.NoError(t, err)
	total, _ = b.prefillState(t, s)
	require.Zero(t, total)
	require.Zero(t, b.state(t, s).Leases)

	// A request larger than the cap is admitted when no prefill is in
	// flight (an engine prefills it in chunks), and then holds the cap.
	big := b.admit(t, b.prefillReq("big", s, 30000, 10000))
	require.True(t, big.Allowed)
	small := b.admit(t, b.prefillReq("small", s, 1, 10000))
	require.False(t, small.Allowed)
	require.Equal(t, LimitPrefill, small.Rejection.Limit)

	// A renewal after the state was lost re-asserts the contribution.
	k := newKeyBuilder(b.prefix, b.org)
	require.NoError(t, b.rdb.Del(ctx, k.scope(&s)[0], k.record("big")).Err())
	st, err = b.lim.Renew(ctx, big.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewReasserted, st)
	total, _ = b.prefillState(t, s)
	require.Equal(t, int64(30000), total)
	_, err = b.lim.Settle(ctx, big.Lease, 0, 0)
	require.NoError(t, err)
	total, _ = b.prefillState(t, s)
	require.Zero(t, total)
}

// TestPrefillExpiredLease: the contribution of a lease that expired
// unrenewed (its proxy was lost) leaves at the next admission on the
// scope, while a renewed lease keeps its own.
func TestPrefillExpiredLease(t *testing.T) {
	t.Parallel()
	const ttl = 500 * time.Millisecond
	b := setup(t, func(c *Config) { c.LeaseTTL, c.RenewInterval = ttl, 50*time.Millisecond })
	ctx := context.Background()
	s := Scope{Kind: KindDeployment, ID: "d", MaxParallel: 8}

	lost := b.admit(t, b.prefillReq("lost", s, 4000, 0))
	require.True(t, lost.Allowed)
	live := b.admit(t, b.prefillReq("live", s, 1000, 0))
	require.True(t, live.Allowed)
	require.Equal(t, int64(5000), live.PrefillInFlight)

	// "live" renews; "lost" does not. Once lost's lease expired, an
	// admission prunes it: the cap of 6000 then fits 5000 more.
	n := 0
	testsvc.Eventually(t, func() bool {
		_, err := b.lim.Renew(ctx, live.Lease)
		require.NoError(t, err)
		n++
		d := b.admit(t, b.prefillReq("probe"+strconv.Itoa(n), s, 5000, 6000))
		if d.Allowed {
			require.Equal(t, int64(6000), d.PrefillInFlight, "live's 1000 and the probe's 5000")
			_, err := b.lim.Cancel(ctx, d.Lease)
			require.NoError(t, err)
		}
		return d.Allowed
	}, 5*ttl, ttl/10, "the lost lease's prefill is pruned after its TTL")
	total, parts := b.prefillState(t, s)
	require.Equal(t, int64(1000), total)
	require.Equal(t, map[string]int64{"live": 1000}, parts)
	// The lost proxy's late settlement is harmless.
	_, err := b.lim.Settle(ctx, lost.Lease, 0, 0)
	require.NoError(t, err)
	total, _ = b.prefillState(t, s)
	require.Equal(t, int64(1000), total)
	_, err = b.lim.Settle(ctx, live.Lease, 0, 0)
	require.NoError(t, err)
	total, _ = b.prefillState(t, s)
	require.Zero(t, total)
}

func TestPrefillInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for name, r := range map[string]Request{
		"scope out of range": {OrgID: b.org, RequestID: "x", Scopes: []Scope{{Kind: KindDeployment, ID: "d", MaxParallel: 1}}, Prefill: &Prefill{Scope: 1}},
		"scope with rpm":     {OrgID: b.org, RequestID: "x", Scopes: []Scope{{Kind: KindDeployment, ID: "d", MaxParallel: 1, RPM: 5}}, Prefill: &Prefill{}},
		"scope without par":  {OrgID: b.org, RequestID: "x", Scopes: []Scope{{Kind: KindDeployment, ID: "d"}}, Prefill: &Prefill{}},
		"negative tokens":    {OrgID: b.org, RequestID: "x", Scopes: []Scope{{Kind: KindDeployment, ID: "d", MaxParallel: 1}}, Prefill: &Prefill{Tokens: -1}},
	} {
		_, err := b.lim.Admit(context.Background(), r)
		require.ErrorIs(t, err, ErrInvalidRequest, name)
	}
}
