package limits

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLocalLimiterShare(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	planes := 4
	l := NewLocalLimiter(func() int { return planes })
	l.now = func() time.Time { return now }
	s := Scope{Kind: KindKey, ID: "k", RPM: 40, TPM: 400}
	req := func(est int64) Request {
		return Request{OrgID: "o", RequestID: "r", Scopes: []Scope{s}, EstTokens: est}
	}

	// Share: 40 rpm / 4 planes = 10.
	for range 10 {
		d, err := l.Admit(req(1))
		require.NoError(t, err)
		require.True(t, d.Allowed)
	}
	d, err := l.Admit(req(1))
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, LimitRPM, d.Rejection.Limit)

	// 60 s later the oldest second is still counted (61 buckets); at 61 s it is gone.
	now = now.Add(60 * time.Second)
	d, _ = l.Admit(req(1))
	require.False(t, d.Allowed)
	now = now.Add(time.Second)
	d, _ = l.Admit(req(1))
	require.True(t, d.Allowed)

	// tpm share 100; reconcile frees the over-estimate.
	d, _ = l.Admit(req(100))
	require.False(t, d.Allowed, "1 + 100 > 100")
	require.Equal(t, LimitTPM, d.Rejection.Limit)
	l.Reconcile(req(1), 0)
	d, _ = l.Admit(req(100))
	require.True(t, d.Allowed)

	// Budget and parallel never fall back.
	_, err = l.Admit(Request{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: KindTeam, ID: "t", MaxParallel: 1}}})
	require.ErrorIs(t, err, ErrNoFallback)
	_, err = l.Admit(Request{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: KindTeam, ID: "t", Budget: &Budget{CapMicros: 1, Window: "1d"}}}})
	require.ErrorIs(t, err, ErrNoFallback)
}
