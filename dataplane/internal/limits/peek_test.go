package limits

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// dump returns every key under the test's prefix with its serialized value.
func (b *bundle) dump(t *testing.T) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	for _, k := range scanKeys(t, b.rdb, b.prefix) {
		v, err := b.rdb.Dump(ctx, k).Result()
		require.NoError(t, err)
		out[k] = v
	}
	return out
}

// TestPeekReadsWhatAdmissionCountsAndWritesNothing: Peek reports the
// requests, tokens, leases and budget spend admissions left in Redis, the
// budget states of a never-used and an unseeded scope, and leaves every
// key (and a fresh org without an epoch) exactly as it was.
func TestPeekReadsWhatAdmissionCountsAndWritesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", RPM: 10, TPM: 1000, MaxParallel: 4, Budget: &Budget{CapMicros: 5000, Window: "1d"}}
	b.ledger.set(KindKey, "k", 100)
	d1 := b.admit(t, b.req("r1", 30, 400, s))
	d2 := b.admit(t, b.req("r2", 20, 400, s))
	require.True(t, d1.Allowed)
	require.True(t, d2.Allowed)
	fresh := Scope{Kind: KindTeam, ID: "never-used", RPM: 5, Budget: &Budget{CapMicros: 10, Window: "1mo"}}

	before := b.dump(t)
	hr, err := b.lim.Peek(ctx, b.org, []Scope{s, fresh})
	require.NoError(t, err)
	require.Equal(t, []Headroom{
		{Requests: 2, Tokens: 50, Leases: 2, BudgetState: BudgetCurrent, SpendMicros: 100 + 400 + 400},
		{BudgetState: BudgetNotHeld},
	}, hr)
	require.Equal(t, before, b.dump(t), "peek writes nothing")

	// A settled request: its reservation and lease are gone.
	_, err = b.lim.Settle(ctx, d1.Lease, 10, 50)
	require.NoError(t, err)
	hr, err = b.lim.Peek(ctx, b.org, []Scope{s})
	require.NoError(t, err)
	require.Equal(t, Headroom{Requests: 2, Tokens: 30, Leases: 1, BudgetState: BudgetCurrent, SpendMicros: 100 + 50 + 400}, hr[0])

	// An org Redis knows nothing of: no epoch is started.
	hr, err = b.lim.Peek(ctx, "org-unknown", []Scope{s})
	require.NoError(t, err)
	require.Equal(t, Headroom{BudgetState: BudgetNotHeld}, hr[0])
	n, err := b.rdb.Exists(ctx, newKeyBuilder(b.prefix, "org-unknown").epoch()).Result()
	require.NoError(t, err)
	require.Zero(t, n)

	_, err = b.lim.Peek(ctx, "bad{org}", []Scope{s})
	require.ErrorIs(t, err, ErrInvalidRequest)
}
