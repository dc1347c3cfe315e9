package budget

import (
	"regexp"
	"strconv"
	"testing"
)

// windowPattern is the admin API's rule (controlplane/internal/admin):
// ParseWindow must accept exactly what it accepts, with the same values.
var windowPattern = regexp.MustCompile(`^([1-9][0-9]{0,3})(h|d|mo)$`)

func checkParse(t *testing.T, s string) {
	u, err := ParseWindow(s)
	m := windowPattern.FindStringSubmatch(s)
	if m == nil {
		if err == nil {
			t.Fatalf("ParseWindow(%q) = %+v, want an error", s, u)
		}
		return
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	if err != nil || u != (Unit{Unit: m[2], N: n}) {
		t.Fatalf("ParseWindow(%q) = %+v, %v; want %s %d", s, u, err, m[2], n)
	}
}

func TestParseWindowMatchesTheAdminRule(t *testing.T) {
	for _, s := range []string{"1h", "24h", "1d", "30d", "7d", "1mo", "12mo", "9999d", "10000d", "0d", "01d",
		"", "d", "mo", "1", "1m", "1mon", "1 d", "-1d", "1D", "1dd", "1hmo", "999mo", "1mo ", "١d"} {
		checkParse(t, s)
	}
}

func FuzzParseWindow(f *testing.F) {
	for _, s := range []string{"1h", "30d", "12mo", "0d", "10000d", "1m"} {
		f.Add(s)
	}
	f.Fuzz(checkParse)
}
