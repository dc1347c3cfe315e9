package gateway

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestLimitsUnseededBudgetIsRecovering: a budget window Redis does not
// hold that cannot be seeded from the ledger (the control plane does not
// answer) is refused with a retryable 503 limits_recovering naming the
// scope; nothing reaches the upstream. Once the ledger answers, the same
// key is served.
func TestLimitsUnseededBudgetIsRecovering(t *testing.T) {
	le := newLimitsEnv(t)
	le.group("m")
	up := &slowUpstream{}
	le.deploy("d1", "m", startUpstream(t, up), nil)
	tok := le.key("k1", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{MaxBudget: ptr(30.0), BudgetDuration: "1d", RpmLimit: ptr[int64](100)}
	})
	le.apply()
	down := errors.New("nats: no responders available for request")
	le.seedErr.Store(&down)
	e := readErr(t, le.post(RouteChat, tok, chatBody("m", "")))
	require.Equal(t, 503, e.Status)
	require.Equal(t, openai.CodeLimitsRecovering, e.Error.Code)
	require.Equal(t, openai.TypeServiceUnavailable, e.Error.Type)
	require.Equal(t, "key:k1", e.Header.Get(openai.HeaderLimitScope))
	require.Equal(t, "budget", e.Header.Get(openai.HeaderLimitType))
	require.Equal(t, "1", e.Header.Get("Retry-After"))
	require.Contains(t, e.Error.Message, "key k1")
	require.Zero(t, up.peak.Load(), "the upstream saw the request")
	has, err := le.rdb.HExists(context.Background(), le.prefix+"{o:o1}:lim:key:k1", "rt").Result()
	require.NoError(t, err)
	require.False(t, has, "the refused request consumed an rpm unit")

	le.seedErr.Store(nil)
	resp := le.post(RouteChat, tok, chatBody("m", ""))
	resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode)
	le.drained()
}
