package gateway

import (
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
)

// refResetString is resetString as it was before appendReset: the
// reference the allocation-free formatting must match.
func refResetString(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	if d < time.Second {
		return strconv.FormatInt(max(d.Milliseconds(), 1), 10) + "ms"
	}
	return d.Round(time.Millisecond).String()
}

// refRateHeaders is setRateHeaders as it was before it formatted every
// value into one string (the reference); the IETF fields only with ietf.
func refRateHeaders(hd http.Header, rh limits.RateHeaders, ietf bool) {
	if rh.LimitRequests <= 0 && rh.LimitTokens <= 0 {
		return
	}
	var policy, state []string
	if rh.LimitRequests > 0 {
		rem := strconv.FormatInt(max(rh.RemainingRequests, 0), 10)
		hd.Set("X-Ratelimit-Limit-Requests", strconv.FormatInt(rh.LimitRequests, 10))
		hd.Set("X-Ratelimit-Remaining-Requests", rem)
		hd.Set("X-Ratelimit-Reset-Requests", refResetString(rh.ResetRequests))
		policy = append(policy, `"rpm";q=`+strconv.FormatInt(rh.LimitRequests, 10)+";w=60")
		state = append(state, `"rpm";r=`+rem+";t="+strconv.FormatInt(ceilSecondsInt(rh.ResetRequests), 10))
	}
	if rh.LimitTokens > 0 {
		rem := strconv.FormatInt(max(rh.RemainingTokens, 0), 10)
		hd.Set("X-Ratelimit-Limit-Tokens", strconv.FormatInt(rh.LimitTokens, 10))
		hd.Set("X-Ratelimit-Remaining-Tokens", rem)
		hd.Set("X-Ratelimit-Reset-Tokens", refResetString(rh.ResetTokens))
		policy = append(policy, `"tpm";q=`+strconv.FormatInt(rh.LimitTokens, 10)+";w=60")
		state = append(state, `"tpm";r=`+rem+";t="+strconv.FormatInt(ceilSecondsInt(rh.ResetTokens), 10))
	}
	if ietf {
		hd.Set("Ratelimit-Policy", strings.Join(policy, ", "))
		hd.Set("Ratelimit", strings.Join(state, ", "))
	}
}

// TestResetStringMatchesDuration: the reset headers' formatting equals
// time.Duration's (rounded to the millisecond) for every millisecond of
// the first ten minutes and random durations up to 1,000 hours.
func TestResetStringMatchesDuration(t *testing.T) {
	for d := time.Duration(-5); d < 10*time.Minute; d += time.Millisecond {
		require.Equal(t, refResetString(d), resetString(d), "%d", int64(d))
		e := d + time.Duration(rand.N(int64(time.Millisecond)))
		require.Equal(t, refResetString(e), resetString(e), "%d", int64(e))
	}
	for range 200_000 {
		d := time.Duration(rand.N(int64(1000 * time.Hour)))
		require.Equal(t, refResetString(d), resetString(d), "%d", int64(d))
	}
}

// TestRateHeadersMatchReference: setRateHeaders writes exactly the
// headers of the reference for every combination of limited kinds, and
// the values it shares are not written into by a later Add.
func TestRateHeadersMatchReference(t *testing.T) {
	cases := []limits.RateHeaders{
		{},
		{LimitRequests: 100, RemainingRequests: 42, ResetRequests: 1500 * time.Millisecond},
		{LimitTokens: 1e12, RemainingTokens: 999999994680, ResetTokens: 60276 * time.Millisecond},
		{LimitRequests: 1e10, RemainingRequests: -3, ResetRequests: 0, LimitTokens: 5, RemainingTokens: 5, ResetTokens: 20 * time.Millisecond},
		{LimitRequests: 1, RemainingRequests: 0, ResetRequests: time.Hour + 5*time.Second, LimitTokens: 1 << 62, RemainingTokens: 1 << 61, ResetTokens: 59999999 * time.Microsecond},
	}
	for range 1000 {
		cases = append(cases, limits.RateHeaders{
			LimitRequests: rand.Int64N(3) * rand.Int64N(1e10), RemainingRequests: rand.Int64N(1e10) - 10, ResetRequests: time.Duration(rand.Int64N(int64(2 * time.Minute))),
			LimitTokens: rand.Int64N(3) * rand.Int64N(1e13), RemainingTokens: rand.Int64N(1e13) - 10, ResetTokens: time.Duration(rand.Int64N(int64(2 * time.Minute))),
		})
	}
	for _, ietf := range []bool{false, true} {
		for _, rh := range cases {
			got, want := http.Header{}, http.Header{}
			setRateHeaders(got, rh, ietf)
			refRateHeaders(want, rh, ietf)
			require.Equal(t, want, got, "%+v ietf %v", rh, ietf)
			if rh.LimitRequests > 0 || rh.LimitTokens > 0 {
				// The OpenAI fields always; the IETF ones only when asked.
				require.Equal(t, ietf, got.Get("Ratelimit") != "", "%+v", rh)
				require.Equal(t, ietf, got.Get("Ratelimit-Policy") != "", "%+v", rh)
			}
			for k := range got {
				got.Add(k, "x")
			}
			for k, v := range got {
				require.Equal(t, append(append([]string(nil), want[k]...), "x"), v, "%s after Add", k)
			}
		}
	}
}

// BenchmarkRateHeaders is setRateHeaders for a request limited by rpm
// and tpm, without and with the IETF fields.
func BenchmarkRateHeaders(b *testing.B) {
	rh := limits.RateHeaders{LimitRequests: 1e10, RemainingRequests: 9999999348, ResetRequests: 60048 * time.Millisecond,
		LimitTokens: 1e12, RemainingTokens: 999999947360, ResetTokens: 60048 * time.Millisecond}
	for _, ietf := range []bool{false, true} {
		b.Run("ietf="+strconv.FormatBool(ietf), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				hd := make(http.Header, 16)
				setRateHeaders(hd, rh, ietf)
			}
		})
	}
}
