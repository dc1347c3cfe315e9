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
	errs := validateLimits(&bad)
	for _, want := range []string{`option "pool_size" is not supported`, `prefix "a{b}"`, "must not be negative",
		"must exceed the renew interval", `fallback "open"`, "max output tokens"} {
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
