package gateway

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// oneByte reads its data a byte at a time.
type oneByte struct{ data []byte }

func (o *oneByte) Read(p []byte) (int, error) {
	if len(o.data) == 0 {
		return 0, io.EOF
	}
	p[0] = o.data[0]
	o.data = o.data[1:]
	return 1, nil
}

// TestReadAllGrowsAsBytesArrive: a body declaring 4 MiB and sending one
// byte costs a small buffer, not the declared length; a body keeping to
// its declared length gets a buffer of exactly that (+1 to see the end).
func TestReadAllGrowsAsBytesArrive(t *testing.T) {
	t.Parallel()
	b, err := readAll(&oneByte{data: []byte("{")}, 4<<20)
	require.NoError(t, err)
	require.Equal(t, "{", string(b))
	require.LessOrEqual(t, cap(b), initialBodyBuffer)

	data := bytes.Repeat([]byte("x"), 100_000)
	b, err = readAll(bytes.NewReader(data), int64(len(data)))
	require.NoError(t, err)
	require.Equal(t, data, b)
	require.Equal(t, len(data)+1, cap(b), "capped at the declared length")

	b, err = readAll(&oneByte{data: data[:5000]}, -1) // chunked: length unknown
	require.NoError(t, err)
	require.Len(t, b, 5000)
	b, err = readAll(strings.NewReader(""), 0)
	require.NoError(t, err)
	require.Empty(t, b)
}
