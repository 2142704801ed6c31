// Microphone barge-in: a plain energy voice-activity detector.
//
// Every 20 ms it measures the RMS level of the last 20 ms of microphone
// audio in dBFS; speech is `holdMs` of consecutive frames above the
// threshold. The browser's echo cancellation keeps the agent's own voice
// out of the signal on most devices; raise the threshold where it does not.

const FRAME_MS = 20;

export class MicVad {
  constructor({ onLevel, onSpeech }) {
    this.onLevel = onLevel;
    this.onSpeech = onSpeech;
    this.thresholdDb = -40;
    this.holdMs = 120;
    this.stream = null;
    this.ac = null;
    this.timer = null;
    this.aboveMs = 0;
    this.armed = true; // one onSpeech per stretch of speech
  }

  get isOn() {
    return this.stream !== null;
  }

  async start() {
    if (this.isOn) return;
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: false },
    });
    this.ac = new AudioContext();
    const source = this.ac.createMediaStreamSource(this.stream);
    const analyser = this.ac.createAnalyser();
    analyser.fftSize = 2048;
    source.connect(analyser);
    const window = Math.min(analyser.fftSize, Math.round((this.ac.sampleRate * FRAME_MS) / 1000));
    const buf = new Float32Array(analyser.fftSize);
    this.timer = setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0;
      for (let i = buf.length - window; i < buf.length; i++) sum += buf[i] * buf[i];
      const db = 10 * Math.log10(sum / window + 1e-12);
      this.onLevel(db);
      this.step(db);
    }, FRAME_MS);
  }

  step(db) {
    if (db >= this.thresholdDb) {
      this.aboveMs += FRAME_MS;
      if (this.aboveMs >= this.holdMs && this.armed) {
        this.armed = false;
        this.onSpeech(db);
      }
    } else {
      this.aboveMs = 0;
      this.armed = true;
    }
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    this.stream = null;
    if (this.ac) this.ac.close().catch(() => {});
    this.ac = null;
    this.aboveMs = 0;
    this.armed = true;
  }
}
