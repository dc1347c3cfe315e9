package gateway

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// recAlerts records the budget alerts a handler publishes.
type recAlerts struct {
	mu sync.Mutex
	as []*usagev1.BudgetAlert
}

func (r *recAlerts) Alert(a *usagev1.BudgetAlert) {
	r.mu.Lock()
	r.as = append(r.as, a)
	r.mu.Unlock()
}

func (r *recAlerts) list() []*usagev1.BudgetAlert {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.as)
}

// TestCarveAlertsPublished: a budget slice carved past thresholds has
// them published at once, named by the scope's org and the key's team as
// a request's alerts are, although no request takes from the slice (each
// reserves more than it holds); the thresholds a later settlement
// crosses are published with that request, and each exactly once.
func TestCarveAlertsPublished(t *testing.T) {
	prefix := "pca" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	lim, err := limits.New(limits.Config{Pipe: pipe, KeyPrefix: prefix, CallTimeout: time.Second,
		Slices: limits.SliceConfig{Enabled: true, Tick: 10 * time.Millisecond, Share: 1},
		Seeds: func(_ context.Context, _ string, needs []limits.SeedNeed) ([]int64, error) {
			return make([]int64, len(needs)), nil
		}})
	require.NoError(t, err)
	require.NoError(t, lim.Bootstrap(context.Background(), "o1"))
	rec := &recAlerts{}
	e := newEnv(t, func(c *Config) { c.Limiter, c.Transport, c.Alerts = lim, memUpstream{}, rec })
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	t.Cleanup(func() { delPrefix(rdb, prefix); _ = rdb.Close() })
	// 42 prompt + 38 completion tokens at $0.1 a token: $8 a request; the
	// reservation (prompt estimate + max_tokens 128) is about twice that.
	e.group("m")
	e.deploy("d1", "m", "http://upstream.invalid/v1", func(d *configv1.Deployment) {
		d.Prices = &configv1.Prices{InputPerToken: 0.1, OutputPerToken: 0.1}
	})
	tok := e.key("kon", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{MaxBudget: ptr(25.0), BudgetDuration: "1d"}
	})
	e.apply()
	ctx := context.Background()
	do := func() {
		t.Helper()
		w := serveSliceBench(e, tok)
		require.Equal(t, http.StatusOK, w.Code, w.Body.String())
		require.NoError(t, e.h.DrainSettlements(ctx))
	}
	// $8 spent exactly (32 %: no threshold).
	do()
	require.Empty(t, rec.list())
	// The slice worker then carves what the reserve leaves ($14.50): the
	// spend, the slice counted, is 90 % (the 50 and 85 % thresholds).
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = lim.RunSlices(wctx) })
	t.Cleanup(func() { stop(); wg.Wait() })
	require.Eventually(t, func() bool { return len(rec.list()) >= 2 }, 10*time.Second, 5*time.Millisecond,
		"the carve's alerts were not published: %v", rec.list())
	// A request reserving more than the slice holds is admitted exactly
	// and settles $8 more: 95 and 100 %, with its request id.
	require.Positive(t, lim.SliceStats().HeldBudgetMicros)
	do()
	got := rec.list()
	require.Len(t, got, 4, "%v", got)
	for i, pct := range []int32{50, 85, 95, 100} {
		a := got[i]
		require.Equal(t, pct, a.GetThresholdPercent())
		require.Equal(t, "o1", a.GetOrgId())
		require.Equal(t, "t1", a.GetTeamId())
		require.Equal(t, limits.KindKey, a.GetScopeKind())
		require.Equal(t, "kon", a.GetScopeId())
		require.Equal(t, int64(25_000_000), a.GetCapMicros())
		require.Equal(t, "1d", a.GetWindow())
		require.Equal(t, "i1", a.GetInstanceId())
		if pct < 95 {
			require.Empty(t, a.GetRequestId(), "a carve's alert names no request")
		} else {
			require.NotEmpty(t, a.GetRequestId())
		}
	}
}
