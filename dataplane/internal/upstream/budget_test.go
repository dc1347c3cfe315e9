package upstream

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRetryBudget(t *testing.T) {
	b := NewRetryBudget(0.2, 3)
	now := time.Unix(1000, 0)
	// A quiet pool: the minimum.
	for range 3 {
		require.True(t, b.TryRetry("g", now))
	}
	require.False(t, b.TryRetry("g", now))
	// 100 requests: 20 retries in the window, the 3 taken included.
	for range 100 {
		b.Request("g", now)
	}
	n := 0
	for b.TryRetry("g", now.Add(time.Second)) {
		n++
	}
	require.Equal(t, 17, n)
	require.True(t, b.Pushback("g", now.Add(time.Second)), "20 retries for 100 requests")
	// Pushback: a minimum of 10 for the proxy's retries, clients are told
	// to stop past 3.
	c := NewRetryBudget(0.2, 10)
	for range 3 {
		require.False(t, c.Pushback("c", now))
		require.True(t, c.TryRetry("c", now))
	}
	require.True(t, c.Pushback("c", now))
	require.False(t, c.Spent("c", now), "the proxy may still retry")
	// Another pool has its own budget.
	require.True(t, b.TryRetry("h", now))
	// The window slides: 10 s later the old requests and retries are gone.
	later := now.Add(RetryBudgetWindow + time.Second)
	req, ret := b.Use("g", later)
	require.Zero(t, req)
	require.Zero(t, ret)
	require.True(t, b.TryRetry("g", later))
}
