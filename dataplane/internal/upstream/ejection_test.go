package upstream

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestInRotation(t *testing.T) {
	now := time.Unix(1000, 0)
	pool := func(n int) []*State {
		out := make([]*State, n)
		for i := range out {
			out[i] = new(State)
		}
		return out
	}
	s := pool(4)
	require.Equal(t, []bool{true, true, true, true}, InRotation(s, now, 50))
	s[0].Health.Park(now, 10*time.Second)
	s[1].Health.Park(now, 20*time.Second)
	require.Equal(t, []bool{false, false, true, true}, InRotation(s, now, 50))
	// A third ejection would take 75% out: the one returning first is
	// used again.
	s[2].Health.Park(now, 5*time.Second)
	require.Equal(t, []bool{false, false, true, true}, InRotation(s, now, 50))
	s[3].Health.Park(now, 30*time.Second)
	require.Equal(t, []bool{true, false, true, false}, InRotation(s, now, 50), "the two returning first are used")
	one := pool(1)
	one[0].Health.Park(now, time.Second)
	require.Equal(t, []bool{true}, InRotation(one, now, 50), "a pool is never emptied")
	// At least one deployment may be out, even of a pool of two at 10%.
	two := pool(2)
	two[1].Health.Park(now, time.Second)
	require.Equal(t, []bool{true, false}, InRotation(two, now, 10))
}
