package dataplane

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Limits settings are checked up front, every problem reported at once;
// Redis URL options the limits client would not honour are refused, not
// ignored.
func TestLimitsConfigValidation(t *testing.T) {
	base := Config{RedisURL: "redis://127.0.0.1:6379/0", RateLimitFallback: RateFallbackClosed}
	require.Empty(t, validateLimits(&base))
	for _, u := range []string{"redis://u:p@h:6380/2", "rediss://h", "unix:///run/redis.sock?db=1"} {
		c := base
		c.RedisURL = u
		require.Empty(t, validateLimits(&c), u)
	}
	bad := base
	bad.RedisURL = "redis://h/0?pool_size=10"
	bad.RedisKeyPrefix = "a{b}"
	bad.LimitsCallTimeout = -time.Second
	bad.LeaseTTL = 500 * time.Millisecond
	bad.RateLimitFallback = "open"
	bad.DefaultMaxOutputTokens = -1
	bad.BudgetSeedWait = -time.Second
	errs := validateLimits(&bad)
	for _, want := range []string{`option "pool_size" is not supported`, `prefix "a{b}"`, "must not be negative",
		"must exceed the renew interval", `fallback "open"`, "max output tokens", "budget seed wait -1s must not be negative"} {
		require.Contains(t, joinErrs(errs), want)
	}
	none := Config{RateLimitFallback: RateFallbackClosed}
	require.Contains(t, joinErrs(validateLimits(&none)), "limits fail closed without Redis")
	cluster := Config{RedisClusterAddrs: []string{"127.0.0.1:7000"}, RedisURL: "redis://h/0?ignored=1", RateLimitFallback: RateFallbackLocal}
	require.Empty(t, validateLimits(&cluster), "with cluster addresses the URL is not used")
}

func joinErrs(errs []error) string {
	s := ""
	for _, e := range errs {
		s += e.Error() + "\n"
	}
	return s
}

// Server settings: zero means the default, negative values are refused,
// every problem at once.
func TestServerConfigValidation(t *testing.T) {
	var c Config
	serverDefaults(&c)
	require.Empty(t, validateServer(&c))
	require.Equal(t, DefaultIdleTimeout, c.IdleTimeout)
	require.Equal(t, DefaultReadHeaderTimeout, c.ReadHeaderTimeout)
	require.Equal(t, DefaultBodyReadTimeout, c.BodyReadTimeout)
	require.Equal(t, DefaultMaxBodyReads, c.MaxBodyReads)
	require.Equal(t, DefaultMaxBodyReadsPerConn, c.MaxBodyReadsPerConn)
	require.Equal(t, DefaultH2MaxConcurrentStreams, c.H2MaxConcurrentStreams)
	bad := Config{ReadHeaderTimeout: -1, IdleTimeout: -time.Second, BodyReadTimeout: -1, MaxBodyReads: 4, MaxBodyReadsPerConn: 5,
		H2MaxConcurrentStreams: -1}
	errs := joinErrs(validateServer(&bad))
	for _, want := range []string{"read header timeout", "idle timeout", "body read timeout", "must not exceed max body reads 4",
		"h2 max concurrent streams -1"} {
		require.Contains(t, errs, want)
	}
}

// The affinity lookups get 100 ms, or the limits deadline when an
// operator set a longer one for a slow Redis (the lookup runs beside the
// admission call on the same Redis).
func TestAffinityCallTimeoutFollowsLimits(t *testing.T) {
	require.Equal(t, 100*time.Millisecond, affinityCallTimeout(DefaultLimitsCallTimeout))
	require.Equal(t, 100*time.Millisecond, affinityCallTimeout(0))
	require.Equal(t, time.Second, affinityCallTimeout(time.Second))
}
